"""`areal-hex bench NAME --json`: one module per benchmark; each measures its baseline in
the same run and returns one JSON object."""
