"""The OpenAI-compatible HTTP server over one AsyncEngine (`gristmill serve`)."""
