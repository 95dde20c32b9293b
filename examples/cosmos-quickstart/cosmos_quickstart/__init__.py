"""cosmos-quickstart: COSMOS in a Flower app of your own."""
