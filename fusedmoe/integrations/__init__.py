"""Integrations with other libraries, each in its own module, imported explicitly.

    import fusedmoe.integrations.transformers   # registers experts_implementation="fusedmoe"

`import fusedmoe` imports none of them, so it never imports (or needs) those libraries.
"""
