"""After (or beside) a run: summary.json, the report's plots, the ledger of groups, and
evaluation of a weights version."""
