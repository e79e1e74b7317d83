"""Pictures and widgets for the notebooks."""
