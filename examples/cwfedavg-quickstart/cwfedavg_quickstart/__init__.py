"""cwfedavg-quickstart: Flower's quickstart-pytorch with a personalised strategy."""
