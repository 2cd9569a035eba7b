"""hbp.graph.torch: capture a PyTorch training step into hbp's IR, one file per stage.

The entry point is `hbp.graph.torch.capture.capture` (also `hbp.graph.capture`); its module
docstring lists the stages in order. This package's own import loads nothing: the stages import
torch when they are imported.
"""
