"""Template records, rendering and validation, the versioned store, the promotion gate, A/B routing."""
