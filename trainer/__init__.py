"""`python -m trainer train …` from a checkout: the reference trainer, rampwatch/trainer/.
Installed, the same command is `rampwatch train …`."""
