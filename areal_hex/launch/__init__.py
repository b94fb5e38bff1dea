"""`areal-hex run`: a whole job as local processes, from the same layout `deploy` renders."""
