"""A picture dropped into a chat with a vision model, the whole way (issue 45 item 5's done-when): the factory's
qwen3vlmoe model and its mmproj published in a repository on the local hub server; the window's library gets the
quant and the encoder beside it; the engine is started with --mmproj and says (/v1/models) that it reads pictures,
so the chat offers them; a PNG file dropped on the chat is sent with the question as an image_url part, answered,
kept in the conversation's folder and shown again from it; deleting the chat deletes the picture. The same model
without its encoder is a text model: no picture is offered."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import pytest
from PySide6.QtGui import QColor, QImage
from PySide6.QtWidgets import QApplication

from runmyai.library.keys import HubKey
from runmyai.paths import AppPaths
from runmyai.ui.controller import AppController
from runmyai.ui.main_window import MainWindow
from runmyai.ui.picture_shots import drop
from tests.app.hubserver import HubServer
from tests.app.test_app_scenario import until
from tests.conftest import run_cli
from tests.qtloop import run_qt

REPO = "acme/Tiny-VL-GGUF"
MODEL, MMPROJ = "Tiny-VL-F32.gguf", "mmproj-Tiny-VL-F16.gguf"


@pytest.fixture(scope="module")
def vl_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    root = tmp_path_factory.mktemp("vl")
    model, mmproj = root / MODEL, root / MMPROJ
    r = run_cli("testmodel", str(model), "--arch", "qwen3vlmoe", "--mmproj", str(mmproj), "--type", "F32", "-q")
    assert r.returncode == 0, r.stderr
    with HubServer() as hub:
        hub.add_file(REPO, MODEL, model.read_bytes(), tags=["gguf"])
        hub.add_file(REPO, MMPROJ, mmproj.read_bytes())
        yield hub


def test_a_picture_dropped_into_a_chat_with_a_vision_model(
    qapp: QApplication, vl_hub: HubServer, tmp_path: Path
) -> None:
    (tmp_path / "presets").mkdir()
    (tmp_path / "resources").mkdir()
    photo = tmp_path / "sunset.png"
    image = QImage(96, 64, QImage.Format.Format_RGB32)
    image.fill(QColor("#e07020"))
    assert image.save(str(photo))
    window = MainWindow()
    c = AppController(window, AppPaths(tmp_path / "home"), hub_endpoint=vl_hub.url,
                      presets_dir=tmp_path / "presets", resources_dir=tmp_path / "resources")  # fmt: skip
    window.show()
    chat = window.chat
    seen: dict[str, object] = {}

    async def flow() -> None:
        await c.start()
        model = await c.models.jobs.get_model(HubKey(REPO, "F32"))
        assert model is not None and model.arch == "qwen3vlmoe"
        encoder = model.path.parent / MMPROJ
        assert encoder.is_file()  # downloaded with the quant, kept beside it
        key, said = f"local:{model.path}", f"Pictures: yes — its image encoder {MMPROJ} is beside it"
        await until(lambda: any(e.key == key and said in e.details_html for e in c.models.entries()), 30, "My models")
        await c.engine.use_model(f"local:{model.path}")
        sup = c.engine.supervisor
        assert sup is not None and sup.flags[sup.flags.index("--mmproj") + 1] == str(encoder)
        assert c.engine.images_task is not None
        await c.engine.images_task
        assert chat.attach_button.isVisible()  # the server said it reads pictures
        window.show_page("Chat")
        c.talks.new_conversation()
        drop(c, photo)  # a drag of the file onto the chat, and its drop (the self-test's pictures do the same)
        assert [p.label for p in chat.attachments.pictures] == ["sunset.png"] and chat.picture_strip.isVisible()
        seen["reply"] = await c.chat.chat_once("What colour is the sky?")
        client = c.engine.chat_client
        assert client is not None and client.last_body is not None and client.last_stats is not None
        seen["body"] = client.last_body["messages"]
        seen["prompt_tokens"] = client.last_stats.prompt_tokens
        # the same question without the picture: its tokens are the picture's fewer
        count = await client.count([{"role": "user", "content": "What colour is the sky?"}])
        seen["text_tokens"] = count.prompt_tokens
        cid = c.talks.conversation_id
        assert cid is not None
        seen["cid"] = cid
        question = c.store.messages(cid)[0]
        seen["images"] = question.images
        folder = c.store.images.folder(cid) if c.store.images is not None else None
        seen["files"] = sorted(p.name for p in folder.iterdir()) if folder is not None else []
        c.talks.open_conversation(cid)  # shown again from the store
        seen["shown"] = dict(chat.transcript.pictures)
        chat.delete_conversation_requested.emit(str(cid))
        c.talks.finish_delete(cid)
        seen["folder_after_delete"] = folder is not None and folder.exists()
        # the same model without its encoder: a text model, no picture offered
        encoder.rename(tmp_path / MMPROJ)
        await c.engine.use_model(f"local:{model.path}")
        sup = c.engine.supervisor
        assert sup is not None and "--mmproj" not in sup.flags
        assert c.engine.images_task is not None
        await c.engine.images_task
        seen["offered_without"] = chat.attach_button.isVisible()
        await c.shutdown()

    try:
        run_qt(qapp, flow, timeout=300)
    finally:
        window.close()
    assert isinstance(seen["reply"], str)
    parts = seen["body"][-1]["content"]  # type: ignore[index]
    assert [p["type"] for p in parts] == ["image_url", "text"] and parts[1]["text"] == "What colour is the sky?"
    sent = base64.b64decode(parts[0]["image_url"]["url"].split(",", 1)[1])
    assert QImage.fromData(sent).pixel(5, 5) == QColor("#e07020").rgb()  # the dropped picture itself
    assert isinstance(seen["prompt_tokens"], int) and isinstance(seen["text_tokens"], int)
    assert seen["prompt_tokens"] > seen["text_tokens"]  # the picture's rows count in the prompt
    assert len(seen["images"]) == 1 and seen["files"] == list(seen["images"])  # type: ignore[arg-type]
    assert seen["shown"] == {0: 1}
    assert seen["folder_after_delete"] is False
    assert seen["offered_without"] is False
