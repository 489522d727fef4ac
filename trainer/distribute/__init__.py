"""Distribution: the strategy a config asks for, and the one reader of TF_CONFIG."""
