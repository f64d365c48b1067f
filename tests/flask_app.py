"""A Flask application behind Werkzeug's ProxyFix, trusting one proxy (the
LB): what it believes of the client, for the forwarding headers' test."""

from flask import Flask, jsonify, request
from werkzeug.middleware.proxy_fix import ProxyFix

flask_app = Flask(__name__)


@flask_app.route("/")
def index():
    return "ok"


@flask_app.route("/whoami")
def whoami():
    return jsonify(remote_addr=request.remote_addr, scheme=request.scheme,
                   host=request.host, request_id=request.headers.get("X-Request-ID"))


app = ProxyFix(flask_app.wsgi_app, x_for=1, x_proto=1, x_host=1)
