"""What a rank's tree shares with other trees of the job or the node: /dev/shm files, files mapped shared,
TCP between ranks (held while one end is restored) and the markers that make a restore node-wide."""
