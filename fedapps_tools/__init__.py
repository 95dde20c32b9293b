"""The tools above the apps: ``fedapps run / compare / report`` (``cli``) and ``compare``. They may import the
strategies and the apps; the core package ``fedapps`` never imports them."""
