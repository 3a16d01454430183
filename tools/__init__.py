"""Developer tools that are not part of the installed package (the headless-browser TensorBoard screenshot, the
rewriting of machine paths in results)."""
