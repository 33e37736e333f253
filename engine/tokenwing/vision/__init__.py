"""Image encoders (issue 45): an mmproj file and an image to the text model's input rows."""
