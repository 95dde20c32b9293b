"""A quickstart-style Flower app for the drop-in strategies' tests."""
