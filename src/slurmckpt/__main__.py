from slurmckpt.cli import main

main()
