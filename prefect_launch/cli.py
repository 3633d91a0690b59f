def app(): print("hi")
