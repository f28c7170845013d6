"""Helpers every stage shares: input validation, batches and devices, small linear algebra."""
