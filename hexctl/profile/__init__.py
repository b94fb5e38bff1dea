"""`areal-hex profile --local`: this machine measured as a cluster for the planner."""
