"""Lightning task and data modules; they never know which attention core they hold."""
