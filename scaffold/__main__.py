from scaffold.cli import main

main()
