"""Server access: an API key on every endpoint but /health, compared in constant time, 401 otherwise; a
non-loopback host without a key is refused unless asked for."""

from __future__ import annotations

import pytest

from ddptrain.serving.access import (AccessError, RequireApiKey, describe_access, is_loopback, resolve_api_key)
from ddptrain.serving.server import main
from tests.helpers import import_optional


def test_every_endpoint_but_health_needs_the_bearer_key():
    fastapi = import_optional("fastapi")
    from fastapi.testclient import TestClient

    app = fastapi.FastAPI()
    app.get("/health")(lambda: {"status": "ok"})
    app.get("/v1/models")(lambda: {"data": []})
    app.post("/v1/completions")(lambda: {"choices": []})
    app.add_middleware(RequireApiKey, api_key="s3cret")
    client = TestClient(app)
    assert client.get("/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}, {"Authorization": "Basic s3cret"}):
        response = client.get("/v1/models", headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == 401, headers
        assert response.headers["www-authenticate"] == "Bearer"
    assert client.post("/v1/completions").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert client.post("/v1/completions", headers={"Authorization": "bearer s3cret"}).status_code == 200


def test_the_key_comes_from_the_flag_the_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("DDPTRAIN_API_KEY", raising=False)
    assert resolve_api_key(None, None) is None
    (tmp_path / "key").write_text("from-file\n")
    assert resolve_api_key(None, tmp_path / "key") == "from-file"
    monkeypatch.setenv("DDPTRAIN_API_KEY", "from-env")
    assert resolve_api_key(None, None) == "from-env" and resolve_api_key("flag", None) == "flag"
    with pytest.raises(AccessError, match="not both"):
        resolve_api_key("flag", tmp_path / "key")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(AccessError, match="is empty"):
        resolve_api_key(None, tmp_path / "empty")


def test_a_non_loopback_host_without_a_key_is_refused_unless_asked_for(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("DDPTRAIN_API_KEY", raising=False)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and not is_loopback("0.0.0.0")
    assert "loopback only" in describe_access("127.0.0.1", None, False)
    assert "API key required" in describe_access("0.0.0.0", "k", False)
    assert "UNAUTHENTICATED" in describe_access("0.0.0.0", None, True)
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path), "--host", "0.0.0.0"])  # refused before any model is loaded
    assert exit_info.value.code == 2
    assert "--host 0.0.0.0 is not a loopback address and no API key is set" in capsys.readouterr().err
