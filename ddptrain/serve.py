"""`python -m ddptrain.serve`: the command; the server is ddptrain.serving.server."""

from ddptrain.serving.server import main

if __name__ == "__main__":
    main()
