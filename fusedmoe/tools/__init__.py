"""The measuring and command-line tools around the layer (nothing in the forward path imports
them): the `fusedmoe` command (cli), its bench / tune / backends / demo subcommands, the EP
benchmark under torchrun (ep_bench), model presets, baselines, roofline ceilings and the
capability matrix."""
