"""The draft-load benchmark and the layer's start-up cost (``hybrid-draft bench``)."""
