from clonemap.supervisor.cli import main

main(prog_name="supervisor")
