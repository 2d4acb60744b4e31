"""Training a model the user names (recipes/your_model.py): its flags and batches (runner.py) and the model built from torchvision, timm or a Hugging Face config (models.py)."""
