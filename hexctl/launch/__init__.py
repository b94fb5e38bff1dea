"""`areal-hex run`: the job's services as local processes, supervised, with live progress."""
