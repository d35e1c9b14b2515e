"""The explainer: rules that turn analyses into ranked findings in plain words."""
