"""GPU checks of your model's fast mode and levers (python -m devtools.your_model.NAME)."""
