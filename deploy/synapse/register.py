"""Registers a user through Synapse's shared-secret admin API and prints the JSON reply
(user_id, access_token, device_id).  register.py BASE_URL SECRET USER PASSWORD [admin]"""
import hashlib
import hmac
import json
import sys
import urllib.request

base, secret, user, password = sys.argv[1:5]
admin = len(sys.argv) > 5 and sys.argv[5] == "admin"
url = base.rstrip("/") + "/_synapse/admin/v1/register"
nonce = json.load(urllib.request.urlopen(url))["nonce"]
mac = hmac.new(secret.encode(), digestmod=hashlib.sha1)
mac.update(b"\0".join([nonce.encode(), user.encode(), password.encode(), b"admin" if admin else b"notadmin"]))
body = json.dumps({"nonce": nonce, "username": user, "password": password, "admin": admin, "mac": mac.hexdigest()}).encode()
req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
print(json.dumps(json.load(urllib.request.urlopen(req))))
