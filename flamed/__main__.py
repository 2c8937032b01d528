from flamed.cli import entry

entry()
