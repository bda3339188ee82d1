"""One small module per memory technique; ``memfit.apply`` composes them in a fixed order.

No technique imports another: each is a transform of the model, the optimizer or the step.
"""
