from dapo.cli import run

run()
