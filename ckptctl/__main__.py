from ckptctl.cli.app import main

main()
