"""The `kvserve` command above both sides: its dispatcher (cli.py) and `kvserve up`, which runs the whole stack."""
