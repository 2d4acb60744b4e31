"""The docs: the code they quote, the commands they show, the numbers they cite, the workshop notebook."""
