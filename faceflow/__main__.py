from faceflow.cli import main

main()
