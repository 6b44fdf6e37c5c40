"""Small shared helpers: logging, errors, optional dependencies, networking, tiny local models."""
