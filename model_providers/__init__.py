"""model_providers."""
