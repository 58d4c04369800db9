"""Built-in recipes: each a spec (`fntrain.run.config.RecipeSpec`) that `fntrain run NAME` runs.

fntrain is imported first so that its process-wide settings (the OpenMP wait policy) precede torch.
"""

import fntrain  # noqa: F401
