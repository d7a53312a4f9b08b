"""`python -m ddptrain.generate`: the command; generation is ddptrain.serving.generation."""

from ddptrain.serving.generation import main

if __name__ == "__main__":
    main()
