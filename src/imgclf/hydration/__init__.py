"""The hydration check before training: is the data set whole, readable and really on the file
system? Its entry point is check.py (`run`); storage.py asks Lustre and times reads,
integrity.py decodes every image."""
