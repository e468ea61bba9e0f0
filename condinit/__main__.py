from condinit.cli import run

run()
