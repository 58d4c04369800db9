"""Built-in recipes: each composes fntrain's builders and exposes a tyro CLI."""
