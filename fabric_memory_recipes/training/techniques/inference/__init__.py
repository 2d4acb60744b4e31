"""The techniques of inference with your model (``recipes/your_model.py --infer``), one module each: int8
weights (``weights_quant``). Their records name them ``inference.<module>``."""
