"""The main window's rooms: one controller per page or job, wired together by `runmyai.ui.controller.AppController`."""
