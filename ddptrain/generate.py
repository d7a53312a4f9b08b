"""`python -m ddptrain.generate`: the command; generation is ddptrain.serving.generate."""

from ddptrain.serving.generate import main

if __name__ == "__main__":
    main()
