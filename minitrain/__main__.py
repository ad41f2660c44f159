"""``python -m minitrain``: the same commands as the ``minitrain`` console script."""

from minitrain.cli import main

if __name__ == "__main__":
    main()
