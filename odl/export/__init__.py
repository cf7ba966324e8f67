"""Export of a checkpoint as a self-contained serving base (``odl-export``)."""
