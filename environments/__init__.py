"""Ready-made environments. Each module runs on its own: ``python environments/<file>.py serve|process|evaluate``."""
