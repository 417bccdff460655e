"""What is installed and what this run selected: the plugin machinery below every layer that asks for a plugin.

``manager`` loads every entry point of group ``torchbay`` into one pluggy manager (a broken plugin is disabled with
one warning) and builds the registries; ``api_version`` is the plugin contract's version and what a plugin's
declared ``TORCHBAY_PLUGIN_API`` means; ``contributions`` and ``fragments`` gather the config sections and
Accelerate-config fragments plugins add; ``selection`` turns names into the selected classes; ``resolve`` merges
the config sources into one tree; ``published`` names the distribution to install for a name nothing registered;
``info`` is what ``torchbay plugins`` shows; ``lazy_class`` defers a plugin's heavy class to its first use.

Plugin authors do not import from here: :mod:`torchbay.plugin` serves the names they may use.
"""
