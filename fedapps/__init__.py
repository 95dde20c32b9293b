"""fedapps: the shared core of the personalised-FL Flower app (config, data, models, client operations,
protocol, pseudo-labels, clustering, results)."""

__version__ = "0.1.0"
