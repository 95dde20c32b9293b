"""What a run writes down: results files, figures, experiment tracking."""
